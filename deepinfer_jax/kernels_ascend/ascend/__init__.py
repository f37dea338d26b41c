"""The Ascend side of the custom-call bridge: the same targets registered for an Ascend PJRT
platform, their device launches built only where the CANN toolkit is found (see ../README.md).
Nothing here has run on Ascend hardware."""
