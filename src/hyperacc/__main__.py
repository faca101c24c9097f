from hyperacc.cli import main

main()
