from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

from operations.usage import usage_view
from operations.views import stats_page

urlpatterns = [
    # Before the admin's own URLs, which would take every path under admin/.
    path("admin/stats/", admin.site.admin_view(stats_page), name="sampling-stats"),
    path("admin/", admin.site.urls),
    # Before the API's catch-all for unknown /v1/ paths (serving.urls): it reads the database.
    path("v1/usage", usage_view, name="v1-usage"),
    path("", include("offline.urls")),  # files and batches: offline jobs
    path("", include("serving.urls")),
]

handler400 = "serving.views.bad_request"
