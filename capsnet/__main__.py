from capsnet.cli import main

raise SystemExit(main())
