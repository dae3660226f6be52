"""The toy world below the data server: the description grammar (``grammar``), the scene model and its renderer
(``scene``), the query language (``query``) and the execution of visual edits (``edits``). The data modules draw
splits and plan edits with them (``datamodules.toy``, ``datamodules.edit_plans``); the data server executes toy edits
(``synth.worker``) and paints descriptions (``synth.painters``) with them."""
