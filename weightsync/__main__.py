from weightsync.apps.cli import main

raise SystemExit(main())
