"""Everything SGLang-facing: the launch command, the patch, the hooks, per-version facts.

Deliberately empty: the SGLang server process imports ``hsextract.sglang.hooks`` (from the
patch or ``--forward-hooks``) and must not pull in the workflow side (yaml, requests,
Snakemake) through this package's ``__init__``.

- ``versions``: one small declaration per supported SGLang release (what differs);
- ``launch``: the extraction-mode ``python -m sglang.launch_server`` command;
- ``flags``: the options a release declares, read from its source, to check that command;
- ``patching``: apply / verify / revert a release's patch, refusing unknown files;
- ``hooks``: the server-side capture behind the patch and ``--forward-hooks``.
"""
