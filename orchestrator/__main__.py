from classify_common.early_stop import stop_on_signals_until_serving

stop_on_signals_until_serving()

from orchestrator.server import main  # noqa: E402 - after the handlers above

# Guarded: worker processes (--processes, orchestrator.workers) are spawned, and a
# spawned process imports the main module again.
if __name__ == "__main__":
    main()
