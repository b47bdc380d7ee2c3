from .export import main

main()
