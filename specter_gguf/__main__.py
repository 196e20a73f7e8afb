from specter_gguf.cli import main

main()
