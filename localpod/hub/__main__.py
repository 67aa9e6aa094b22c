from localpod.hub.server import main

main()
