"""Pieces several backends share: the mask rule for the CuTe DSL (cute_mask; Triton's is the template macro
file templates/triton_mask.jinja), host-side helpers of the CuTe backends (cute_host), input preparations
(inputs).
No backend reaches into another's private names: what two need lives here."""
