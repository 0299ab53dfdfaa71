"""Decode attention kinds shared by several models (kda, mla, gqa, sparse, dcp_merge)."""
