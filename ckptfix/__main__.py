from ckptfix.cli.app import main

main()
