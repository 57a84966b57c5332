"""Pieces several backends share, one module per language: the mask rule for Triton (triton_mask) and the
CuTe DSL (cute_mask), host-side helpers of the CuTe backends (cute_host), input preparations (inputs).
No backend reaches into another's private names: what two need lives here."""
