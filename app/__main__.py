from app.cli.command import main

# Guarded: render worker processes are spawned, and a spawned child imports the parent's
# main module again.
if __name__ == "__main__":
    raise SystemExit(main())
