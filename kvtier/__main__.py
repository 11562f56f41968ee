from kvtier.cli import main

raise SystemExit(main())
