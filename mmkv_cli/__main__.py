from mmkv_cli.cli.entry import main

main()
