"""`python -m kev.demo` (the README's main job): the whole stack on CPU, answering the examples.

Starts a private Redis, the bank service and one scorer (kev.stack), sends the example requests
through the public gRPC API with the client library (kev.rpc.client), prints the answers, and shuts
everything down. `--in-process` scores them with kev.engine.Engine instead (no services).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch

from kev.rpc.client import KevClient
from kev.demo.evaluate import DEFAULT_CHECKPOINT
from kev.demo.examples import EXAMPLES, format_all
from kev.engine import Engine
from kev.stack import Stack


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Score the demo example requests and print the answers.")
    parser.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--in-process", action="store_true", help="use the in-process engine, no services")
    args = parser.parse_args(argv)
    requests = [example.request for example in EXAMPLES]
    if args.in_process:
        torch.set_num_threads(2)
        engine = Engine.from_checkpoint(args.checkpoint)
        responses = [engine.score(r) for r in requests]
    else:
        start = time.perf_counter()
        with Stack(args.checkpoint) as stack:
            print(f"stack up in {time.perf_counter() - start:.1f} s: redis + bank ({stack.bank_addr}) + "
                  f"scorer ({stack.scorer_addr})\n")
            with KevClient(stack.scorer_addr, args.checkpoint) as client:
                responses = [client.score(r, timeout=60) for r in requests]
        print("stack shut down\n")
    print(f"model {responses[0].model} ({args.checkpoint})\n")
    print(format_all(EXAMPLES, responses))


if __name__ == "__main__":
    main()
