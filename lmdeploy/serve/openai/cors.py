"""CORS for browser clients (LMDeploy's `--allow-origins`, `--allow-credentials`, `--allow-methods`,
`--allow-headers`), by Starlette's `CORSMiddleware`. Off unless origins are given; it runs before the API-key check
so that preflight `OPTIONS` requests (which carry no credentials) are answered."""
from __future__ import annotations

from dataclasses import dataclass

from starlette.middleware.cors import CORSMiddleware


@dataclass(frozen=True)
class CorsConfig:
    allow_origins: tuple[str, ...] = ()
    allow_credentials: bool = False
    allow_methods: tuple[str, ...] = ('*',)
    allow_headers: tuple[str, ...] = ('*',)

    def __post_init__(self):
        if self.allow_credentials and '*' in self.allow_origins:
            raise ValueError("--allow-credentials cannot be used with --allow-origins '*' (browsers refuse it); "
                             'list the origins')

    def install(self, app) -> None:
        if self.allow_origins:
            app.add_middleware(CORSMiddleware, allow_origins=list(self.allow_origins),
                               allow_credentials=self.allow_credentials, allow_methods=list(self.allow_methods),
                               allow_headers=list(self.allow_headers))
