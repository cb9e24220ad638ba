from sluice.app.cli import main

main()
