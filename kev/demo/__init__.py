"""The demo decision model: a synthetic task family, its training script and example requests.

    python -m kev.demo                                 score the example requests (kev/demo_model)
    python -m kev.demo.train --out kev/demo_model      retrain the shipped checkpoint from scratch
    python -m kev.demo.evaluate                        held-out accuracy through the serving path

Modules: `domains` (the content), `tasks` (seeded generator and word-level tokenizer),
`train_ops` (documents and rows in one differentiable pass), `train`, `evaluate`, `examples`.
"""
