from fxpipe.distributed.launch import main

main()
