from kvgraft.cli.app import main

main()
