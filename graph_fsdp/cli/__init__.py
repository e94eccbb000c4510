"""The ``graph-fsdp`` command line: ``train``, ``compare``, ``bench`` and ``profile``.

Flags use Megatron-LM spellings (``--num-layers``, ``--cuda-graph-scope attn``, ...) and are
validated before any process group or GPU context exists; see ``graph-fsdp <command> -h``.
"""
