"""`rexrag` command: dispatches sub-commands to the module that owns them.

Each entry maps a sub-command to "module:function"; the function takes argv (list[str]) and
returns an exit code. Modules are imported lazily so `rexrag --help` is instant.
"""
import importlib
import sys

COMMANDS = {
    "demo": ("rexrag_jax.demo:main", "embedded end-to-end run: synthetic world, warm start, REX-RAG, eval"),
    "train": ("rexrag_jax.train.main:main", "REX-RAG / GRPO training from gin files"),
    "eval": ("rexrag_jax.evaluation.main:main", "greedy evaluation or re-scoring of trajectory dumps"),
    "build-index": ("rexrag_jax.retrieval.cli:build_index_main", "encode a corpus and build a ScaNN/exact index"),
    "merge-index": ("rexrag_jax.retrieval.cli:merge_index_main", "merge per-host part indexes into one index"),
    "serve-retriever": ("rexrag_jax.retrieval.cli:serve_main", "Search-R1 compatible POST /retrieve server"),
    "generate": ("rexrag_jax.generation.demo:main", "sample from a policy (tiny random model by default)"),
    "build-trace-buffer": ("rexrag_jax.rapo.build_cli:main", "static RAPO trace buffer from a stronger policy's rollouts"),
    "plan": ("rexrag_jax.train.planner:main", "memory plan per device for a gin config and mesh"),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print("usage: rexrag <command> [args]\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:16s} {help_text}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"rexrag: unknown command {name!r}; expected one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module_name, func_name = COMMANDS[name][0].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
