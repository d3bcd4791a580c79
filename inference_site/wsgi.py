from __future__ import annotations

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_site.settings")

# Django's app, with the generating endpoints served past its middleware (inference_site.direct).
django_application = get_wsgi_application()

from inference_site.direct import DirectRoutes  # noqa: E402 - needs the settings configured

application = DirectRoutes(django_application)
