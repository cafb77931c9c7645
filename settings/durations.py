"""Composer's time strings ('10ba', '20000sp', '1ep', '0.5dur') read without Composer, so that config.py checks a
run's durations before torch loads. The same grammar and rules as `composer.core.Time.from_timestring`: a number
(scientific notation allowed) then a unit, case-insensitive, whole numbers for every unit but 'dur'; the builders
hand the text on to Composer, which parses it again. `parse_time` and `parse_interval` check a flag's time string,
with a ConfigError naming the flag."""

import re
from dataclasses import dataclass

from guards.arguments import ConfigError

UNITS = ('iter', 'ep', 'ba', 'sp', 'tok', 'dur', 'sec')  # composer.core.TimeUnit's values
TIME_STRING = re.compile(r'^(.+?)(' + '|'.join(UNITS) + r')$', flags=re.IGNORECASE)
EXAMPLES = {'ba': "'1000ba'", 'ep': "'1ep'", 'sp': "'20000sp'", 'dur': "'0.5dur'"}


@dataclass(frozen=True)
class Duration:
    """A parsed time string: its value and unit ('ba', 'sp', 'ep', ...)."""

    value: int | float
    unit: str

    def to_timestring(self) -> str:
        return f'{self.value}{self.unit}'

    def __str__(self) -> str:
        return self.to_timestring()


def parse_duration(text: str) -> Duration:
    """A time string as Composer reads it; ValueError (not a time string) or TypeError (a fraction of a unit that
    counts whole ones, as Composer raises) otherwise."""
    match = TIME_STRING.match(str(text).strip())
    try:
        value = float(match.group(1)) if match else None
    except ValueError:
        value = None
    if value is None:
        raise ValueError(f'Invalid time string: {text}')
    unit = match.group(2).lower()
    if unit != 'dur':
        if int(value) != value:
            raise TypeError(f'value {value} is not an integer. Units {unit!r} require integer values.')
        value = int(value)
    return Duration(value, unit)


def parse_half_life(text: str) -> Duration:
    """The EMA's half life (--ema_half_life): a positive whole number of batches or epochs, with ema.EMA's messages."""
    allowed = f'{EXAMPLES["ba"]}, {EXAMPLES["ep"]}'
    try:
        time = parse_duration(text)
    except (TypeError, ValueError):
        raise ValueError(f'EMA half_life={text!r}: not a Composer time string (use e.g. {allowed})') from None
    if time.unit not in ('ba', 'ep'):
        raise ValueError(f'EMA half_life={text!r}: unit {time.unit!r} is not supported here (use e.g. {allowed})')
    if time.value <= 0:
        raise ValueError(f'EMA half_life={text!r}: must be positive')
    return time


def parse_time(flag: str, text: str) -> Duration:
    """A positive Composer time string in batches, samples or epochs."""
    try:
        time = parse_duration(text)
    except (ValueError, TypeError) as error:  # TypeError: a fraction of a unit that counts whole ones ('1.5ep')
        raise ConfigError(f"{flag} {text!r}: {error} (examples: '10ba', '1ep', '20000sp')")
    if time.unit not in ('ba', 'sp', 'ep'):
        raise ConfigError(f"{flag} {text}: use batches, samples or epochs ('10ba', '20000sp', '1ep')")
    if time.value <= 0:
        raise ConfigError(f"{flag} {text}: must be positive (examples: '10ba', '1ep', '20000sp')")
    return time


def parse_interval(flag: str, text: str | None) -> str | None:
    """An evaluation interval: a positive Composer time string, or None for never ('0' or unset)."""
    if text is None or text.strip() == '0':
        return None
    parse_time(flag, text)
    return text


def batches_of(duration: Duration, batch_size: int) -> int | None:
    """A duration of batches or samples in batches of `batch_size` (Composer trains until a batch reaches the
    samples); None for epochs, whose batches depend on the data."""
    if duration.unit == 'ba':
        return int(duration.value)
    if duration.unit == 'sp':
        return -(-int(duration.value) // batch_size)
    return None
