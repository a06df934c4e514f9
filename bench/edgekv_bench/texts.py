"""Built-in text for demos and benchmarks: an assistant's system prompt and documents.

Written for this project (no dataset is fetched). Long enough that its token count exceeds the
contexts the benchmarks ask for; benchmarks cut it to an exact token length.
"""

from __future__ import annotations

__all__ = ["MANUAL", "QUESTIONS", "SYSTEM_PROMPT"]

SYSTEM_PROMPT = (
    "You are Aria, the on-device assistant of the Lumen X2 smart home hub. Answer briefly and "
    "accurately, using only the manual below. If the manual does not say, answer that you do "
    "not know and suggest contacting support."
)

MANUAL = """\
Lumen X2 Hub - Owner's Manual (excerpt)

1. Getting started. The Lumen X2 hub connects lights, thermostats, door sensors and cameras in
one home network. Place the hub near the centre of the house, at least one metre above the
floor and away from microwave ovens, which disturb the 2.4 GHz radio. Connect the supplied
12 V power adapter; the ring light turns blue while the hub starts, which takes about forty
seconds. When the ring pulses white, open the Lumen app, tap Add Hub and scan the code printed
under the hub. The app asks for the name and password of your Wi-Fi network; the hub supports
2.4 GHz and 5 GHz networks with WPA2 or WPA3 security, but not open or WEP networks.

2. Adding devices. Tap Add Device and choose the kind of device. Zigbee devices pair when they
are within ten metres of the hub; put the device in pairing mode (usually by holding its
button for five seconds) and wait for the app to show it. Thread and Matter devices are added
by scanning their Matter code. Each hub holds up to 128 devices. Battery devices report their
level every six hours; the app warns below 15 percent. Devices that have not reported for two
days are marked offline, and their automations are paused until they come back.

3. Automations. An automation has a trigger (a time, sunrise or sunset, a sensor reading, a
device state or your phone arriving home), optional conditions (only on weekdays, only when
nobody is home) and actions (turn on, turn off, set a level, send a notification). Up to 200
automations can run on the hub itself; they keep working when the internet is down because
the hub evaluates them locally. Scenes store the state of several devices and restore them with
one tap; a scene can be an action of an automation.

4. Energy. The Energy tab shows the consumption of smart plugs and of the whole house when a
Lumen meter clamp is installed on the main cable. Readings are taken every ten seconds and kept
on the hub for thirteen months; daily totals are kept for five years. Tariffs can be entered
with up to four time bands, and the hub then estimates the cost of each device per day.

5. Privacy and security. Camera video is processed on the hub and stored on the microSD card
(up to 1 TB, exFAT). Nothing leaves the house unless cloud backup is enabled, in which case
clips are encrypted on the hub before upload. Two-factor sign-in is required for remote access.
The hub installs security updates automatically between 2 and 4 in the morning; feature
updates wait until you accept them in the app.

6. Troubleshooting. A red ring means the hub has no network; check the router and the cable,
then restart the hub by unplugging it for ten seconds. An orange ring means an update is being
installed; do not unplug the hub. If a Zigbee device stops responding, move it closer or add a
mains-powered Zigbee device in between as a repeater. To reset the hub to factory settings,
hold the button on the back for twenty seconds until the ring flashes red three times; this
erases all devices, automations and recordings.

7. Warranty and support. The hub has a two-year warranty that covers defects in materials and
workmanship but not damage from water, drops or unauthorised repairs. Support is available by
chat in the app every day from 8 in the morning to 10 in the evening, and by email at any time.
Keep your receipt: the serial number and the purchase date are needed for any claim.

8. Technical data. Radios: Wi-Fi 6 (2.4 and 5 GHz), Zigbee 3.0, Thread 1.3, Bluetooth 5.2.
Processor: quad-core ARM Cortex-A55 at 1.8 GHz with 2 GB of memory and 16 GB of storage.
Power: 12 V DC, 1 A; typical consumption 3.5 W. Operating temperature 0 to 40 degrees Celsius,
humidity up to 85 percent without condensation. Size 120 x 120 x 38 mm, weight 310 g.
"""

QUESTIONS = (
    "How long does the hub take to start?",
    "Which Wi-Fi security modes are supported?",
    "How many devices can one hub hold?",
    "What does an orange ring mean?",
    "How do I reset the hub to factory settings?",
    "Where is camera video stored?",
    "What does the warranty not cover?",
    "How often are energy readings taken?",
    "Do automations work without internet?",
    "What is the typical power consumption?",
)
