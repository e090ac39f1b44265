import os

# How long torch's idle OpenMP threads spin before they sleep, read once when torch
# loads. GNU OpenMP's default (300,000 spins) keeps them burning a core after every
# op, which the serving loops need: measured on 2 cores through the front door, 1,000
# served topic-static at 64 clients with 190-260 us of capability CPU per request
# against 500-570 us, and topic-minilm as fast (alternated A/B). Set it to override.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

from capability.server import main

main()
