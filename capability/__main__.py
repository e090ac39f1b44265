import os

from classify_common.early_stop import stop_on_signals_until_serving, stop_with_launcher

stop_on_signals_until_serving()
stop_with_launcher()

# How long torch's idle OpenMP threads spin before they sleep, read once when torch
# loads. GNU OpenMP's default (300,000 spins) keeps them burning a core for a while
# after every forward, which the serving loops need. Too few spins, and they sleep
# between the ops of one forward instead, and each op pays for waking them: with
# 1,000, one text through the front door on 2 cores took 12.5-13.5 ms at p50 against
# 8.6-9.2 ms with 10,000 (one forward alone: 8.0 against 3.7 ms); 3,000 is already
# on that cliff's edge (9.8 ms). The spinning is paid for in CPU, not throughput:
# topic-static at 64 clients spent the same capability CPU a request as with 1,000,
# topic-minilm at 32 clients the same requests a second for about 3% more CPU in
# the capability and 5% more in the orchestrator beside it (alternated A/B,
# docs/benchmark.md). Set it to override.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

# The tokenizers library spreads a batch's texts over a thread pool of its own unless
# this says no. Most batches it gets here are a coalesced call's dozen or so short
# texts, tokenized on the event loop, where the pool saves no time: it adds threads
# that spin between batches and compete with the device for cores. On 2 cores, 64
# texts took 1,667 us of CPU with the pool and 1,412 without; topic-static at 64
# clients through the front door spent 180 us of capability CPU a request without
# it against 192 with it, ClassifyBatch x64 on topic-minilm the same (alternated
# A/B, docs/benchmark.md). Set it to override.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from capability.server import main  # noqa: E402 - after the handlers and variables above

main()
