from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("sampling", "0005_limits_response_cache_shared"),
    ]

    operations = [
        migrations.AddField(
            model_name="usageminute",
            name="cached_tokens",
            field=models.PositiveBigIntegerField(
                default=0,
                help_text="Of the prompt tokens: those of prompts answered from the cache.",
            ),
        ),
    ]
