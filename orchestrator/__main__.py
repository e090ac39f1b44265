from orchestrator.server import main

# Guarded: worker processes (--processes, orchestrator.workers) are spawned, and a
# spawned process imports the main module again.
if __name__ == "__main__":
    main()
