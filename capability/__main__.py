from capability.server import main

main()
