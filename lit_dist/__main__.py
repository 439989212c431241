from lit_dist.cli import main

if __name__ == "__main__":
    main()
