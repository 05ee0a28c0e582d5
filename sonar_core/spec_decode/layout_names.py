"""Names of the published block-drafter layouts (DFlash, DSpark), apart from their readers in
:mod:`sonar_core.spec_decode.block_layout`: plugins name them when they register, which every
configuration check does, and the readers import torch."""

ZLAB_DFLASH = "z-lab DFlash"
DEEPSPEC_DSPARK = "DeepSpec DSpark"
SPECULATORS_DFLASH = "speculators dflash"
SPECULATORS_DSPARK = "speculators dspark"
