"""The steering kernel: torch only, no engine, no I/O.

- :mod:`.tilt`: :func:`apply_gravity`, the one place the math lives;
- :mod:`.field`: :class:`NarrativeField`, how fields combine, and continuation matching;
- :mod:`.schedule`: the per-row schedule table and the rules that read it every step;
- :mod:`.controllers`: constant, phases, decay and the thermostat, as users name them;
- :mod:`.solve`: the thermostat's search for the smallest λ that reaches its target;
- :mod:`.stages`: a plan's stages and per-row stage tracking;
- :mod:`.thermo`: measurement (entropy, narrative mass, KL), which observes and never decides;
- :mod:`.kernel`: :class:`GravityKernel`, per-row state and one step over a batch.

Engines (``narrative_gravity.engines``) only translate their bookkeeping into kernel rows.
"""

from .controllers import (
    ConstantController,
    DecayOptions,
    PhaseScheduleController,
    ScheduleController,
    StepContext,
    StrengthController,
    ThermostatController,
    ThermostatOptions,
)
from .field import NarrativeField, WordReport
from .kernel import GravityKernel, Program, StepResult
from .solve import solve_strength
from .stages import StagePlan
from .thermo import Measurement, Trace, measure
from .tilt import apply_gravity, prune_mask

__all__ = [
    "ConstantController",
    "DecayOptions",
    "GravityKernel",
    "Measurement",
    "NarrativeField",
    "PhaseScheduleController",
    "Program",
    "ScheduleController",
    "StagePlan",
    "StepContext",
    "StepResult",
    "StrengthController",
    "ThermostatController",
    "ThermostatOptions",
    "Trace",
    "WordReport",
    "apply_gravity",
    "measure",
    "prune_mask",
    "solve_strength",
]
