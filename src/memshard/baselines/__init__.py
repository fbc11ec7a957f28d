"""The strategies people use by hand, as fixed plans in memshard's own search space:
``rules.py`` builds a complete plan from simple rules (each op split by a function of the op,
every parameter stored one way), ``recipes.py`` names the frameworks' recipes (DDP, FSDP2,
ZeRO, Megatron-LM, torch TP) and builds each from those rules."""
