"""The project's command line (``python train.py fit|validate|test|predict|export``): ``cli.main``."""
