"""What a request that names no sampling parameters gets: the model's own recommendation.

OpenAI's defaults (temperature 1, top_p 1) sample from the whole
distribution, which small instruct models answer with noise. Like vLLM, a
head therefore fills the parameters a request leaves out from the model's
`generation_config.json` when it asks for sampling (`do_sample: true`), and
from OpenAI's defaults otherwise. A request's own values always win.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Final

logger = logging.getLogger(__name__)

OPENAI_TEMPERATURE: Final = 1.0
OPENAI_TOP_P: Final = 1.0
NO_TOP_K: Final = 0


@dataclass(frozen=True)
class SamplingDefaults:
    """Values for the sampling parameters a request omits."""

    temperature: float = OPENAI_TEMPERATURE
    top_p: float = OPENAI_TOP_P
    top_k: int = NO_TOP_K

    @classmethod
    def from_folder(cls, path: Path) -> SamplingDefaults:
        """The model's recommended sampling, or OpenAI's defaults when it recommends none."""
        file = path / "generation_config.json"
        try:
            config = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
        except (OSError, ValueError) as exc:
            logger.warning("unreadable %s (%s): using OpenAI's sampling defaults", file, exc)
            return cls()
        if not config.get("do_sample"):
            return cls()
        defaults = cls(
            temperature=float(config.get("temperature", OPENAI_TEMPERATURE)),
            top_p=float(config.get("top_p", OPENAI_TOP_P)),
            top_k=int(config.get("top_k", NO_TOP_K) or NO_TOP_K),
        )
        logger.info("requests without sampling parameters use the model's: %s", defaults)
        return defaults
