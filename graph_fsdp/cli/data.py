"""Token files of ``--data-path``: re-exported from :mod:`graph_fsdp.data`, where they live."""

from graph_fsdp.data import TOKEN_BYTES, TOKEN_DTYPE, TokenFileDataset, check_token_file

__all__ = ["TOKEN_BYTES", "TOKEN_DTYPE", "TokenFileDataset", "check_token_file"]
