"""Write the synthetic world (corpus, train/test questions, warm-start trajectories) to a directory.

    python -m rexrag_jax.data.synth_cli --out /tmp/world [--seed 0] [--dead-end-fraction 0.2]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from rexrag_jax.data.synthetic_world import WorldConfig, generate_world, write_world
from rexrag_jax.data.warmstart import make_warmstart


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rexrag_jax.data.synth_cli", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dead-end-fraction", type=float, default=0.2)
    p.add_argument("--num-person", type=int, default=WorldConfig.num_person)
    p.add_argument("--num-city", type=int, default=WorldConfig.num_city)
    p.add_argument("--num-country", type=int, default=WorldConfig.num_country)
    p.add_argument("--num-company", type=int, default=WorldConfig.num_company)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    cfg = WorldConfig(seed=args.seed, num_person=args.num_person, num_city=args.num_city,
                      num_country=args.num_country, num_company=args.num_company)
    world = generate_world(cfg)
    traj = make_warmstart(world, dead_end_fraction=args.dead_end_fraction, seed=args.seed)
    paths = write_world(world, args.out, traj)
    info = {"entities": len(world.names), "train": len(world.train), "test": len(world.test),
            "warmstart": len(traj), "seconds": round(time.perf_counter() - t0, 2), "paths": paths}
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
