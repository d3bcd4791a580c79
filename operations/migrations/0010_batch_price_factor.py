from decimal import Decimal

import django.core.validators
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("sampling", "0009_owner_budgets"),
    ]

    operations = [
        migrations.AddField(
            model_name="registeredmodel",
            name="batch_price_factor",
            field=models.DecimalField(
                decimal_places=2,
                default=Decimal("0.5"),
                help_text="Offline jobs' tokens (the Batch API) pay the prices times this, 0 to 1.",
                max_digits=3,
                validators=[
                    django.core.validators.MinValueValidator(Decimal("0")),
                    django.core.validators.MaxValueValidator(Decimal("1")),
                ],
            ),
        ),
    ]
