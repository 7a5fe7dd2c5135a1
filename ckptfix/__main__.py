from ckptfix.cli.entry import main

main()
