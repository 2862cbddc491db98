"""A Griffe extension for the API reference: classes whose docstring is completed at import time.

`AutoTrainer` and `Tuner` document their arguments once, in autotune/tuning/arguments.py and (the
Tuner's options) at the fields of the options records, and the `with_arguments` decorator appends
them to the class docstring when the module is imported.
Griffe reads the source, not the imported class, so without this the reference would show only
the docstring's first lines and none of the arguments. Here those classes' docstrings are taken
from the imported classes (tests/test_docs.py checks every parameter reaches the built site).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import griffe

RUNTIME_DOCSTRINGS = ("autotune.trainer.AutoTrainer", "autotune.tuner.Tuner")


class RuntimeDocstrings(griffe.Extension):
    def on_class_instance(self, *, node: Any, cls: griffe.Class, agent: Any, **kwargs: Any) -> None:
        if cls.path not in RUNTIME_DOCSTRINGS:
            return
        module, name = cls.path.rsplit(".", 1)
        text = inspect.cleandoc(getattr(importlib.import_module(module), name).__doc__ or "")
        if cls.docstring is None:
            cls.docstring = griffe.Docstring(text, parent=cls)
        else:
            cls.docstring.value = text
