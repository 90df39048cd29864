"""Pre-tokenized inputs (``{"input_ids", "answer_start_idx"}`` JSON Lines) for runs that need
conversations of varied lengths without a tokenizer; shared by the balanced-order tests."""

import json
import random


def tokens_input(path, count=300, seed=0):
    """Write ``count`` records of 8-200 tokens (ids 3-48 between 1 and 2) to ``path``; returns it."""
    r = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            n = r.choice([8, 16, 30, 60, 120, 200])
            ids = [1] + [r.randrange(3, 49) for _ in range(n - 2)] + [2]
            f.write(json.dumps({"input_ids": ids, "answer_start_idx": n // 2}) + "\n")
    return str(path)
