"""Driver flag sets that several megatron tests run with, on top of tests/helpers/mcore.py's
``TINY``: a layout (``DISTOPT_OVERLAP``) and a method's settings (``SEPARATE``)."""

DISTOPT_OVERLAP = [
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
    "--ddp-bucket-size",
    "20000",
]
"""The distributed optimizer with overlapped gradient reduction and parameter gather, in
small buckets (several per model)."""

SEPARATE = [
    "--grad-compression",
    "separate",
    "--separate-ratio",
    "16",
    "--separate-block-size",
    "256",
]
"""SEPARATE at ratio 16 in blocks of 256."""
