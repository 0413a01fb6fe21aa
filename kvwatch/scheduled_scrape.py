"""The scraper the collector's scheduled scrapes run (``create_app(settings,
scraper=scrape_target)``, wired by ``kvwatch serve``): ``kvwatch scrape``'s own target
reading and translation behind the collector's protocol (:class:`collector.scrape.Scraper`),
its errors sorted into the failures the collector counts.

It sits beside the scraper package, not in it, because it imports the collector, which the
scraper itself never does (``tests/test_architecture.py``).
"""

from __future__ import annotations

from collector.scrape import ScrapeFailed
from collector.settings import ScrapeTarget
from kvwatch.scrape import (
    NodeFigures,
    NotThatEngine,
    ScrapeError,
    TargetScraper,
    TargetUnreachable,
    make_target,
)


class _TargetScrape:
    """One target, read again and again by one :class:`TargetScraper` (which remembers its
    side documents between scrapes)."""

    def __init__(self, scraper: TargetScraper) -> None:
        self._scraper = scraper

    @property
    def shown(self) -> str:
        return self._scraper.target.shown

    def __call__(self) -> tuple[NodeFigures, ...]:
        try:
            return self._scraper.scrape().nodes
        except TargetUnreachable as exc:
            raise ScrapeFailed("target_down", str(exc)) from None
        except NotThatEngine as exc:
            raise ScrapeFailed("not_that_engine", str(exc)) from None
        except ScrapeError as exc:
            raise ScrapeFailed("malformed", str(exc)) from None


def scrape_target(target: ScrapeTarget, timeout_s: float) -> _TargetScrape:
    """``target``'s scraper; a target ``make_target`` refuses raises its ``BadTarget`` (a
    ``ValueError``), as ``kvwatch scrape --target`` would refuse it."""
    return _TargetScrape(
        TargetScraper(
            make_target(
                target.url,
                target.engine,
                node=target.node,
                role=target.role,
                api_key=target.api_key,
            ),
            timeout_s=timeout_s,
        )
    )
