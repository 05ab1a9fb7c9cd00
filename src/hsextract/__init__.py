"""hsextract: reproducible, verified hidden-state extraction for EAGLE-3 drafter training.

Kept import-light on purpose: the SGLang server process imports ``hsextract.capture``
and must not pull in Snakemake, pandas or HTTP clients.
"""

__version__ = "0.1.0"
