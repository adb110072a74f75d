from kvgraft.cli.main import main

main()
