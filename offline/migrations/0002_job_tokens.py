from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("offline", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="prompt_tokens",
            field=models.PositiveBigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="job",
            name="completion_tokens",
            field=models.PositiveBigIntegerField(default=0),
        ),
    ]
