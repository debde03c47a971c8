from usp_hal.cli import main

raise SystemExit(main())
