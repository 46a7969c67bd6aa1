"""The model definitions: the architectures' config and presets (config), CapsNet with dynamic routing (capsnet),
matrix capsules with EM routing (em), the any-size shared-capsule CapsNet and its global-average-pooling CNN
baseline (any_size), the plain CNN baseline (cnn_baseline), and rebuilding any of them from a checkpoint
(checkpoint). The bottom layer of the torch code: training, export, runtime and serving import it, and it imports
none of them (pyproject.toml's import-linter contracts)."""
