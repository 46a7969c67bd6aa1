"""Training side of capsnet-serve: the CapsNet model, data, loss, training loop and checkpoints."""
