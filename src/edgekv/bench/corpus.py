"""Text corpus for the on-device-assistant benchmark workload: 8 assistant deployments.

Each cluster models one deployment: a long shared context (a system prompt followed by a
document, tool list, policy or source file) and short user turns. Every cluster has 8 intents,
and every intent is worded 4 different ways, as different users would ask the same question.

All texts were written for this project; no dataset is fetched. Products, companies and the
medicine described here are fictional.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CLUSTERS", "Cluster"]


@dataclass(frozen=True, slots=True)
class Cluster:
    name: str
    system: str
    intents: tuple[tuple[str, str, str, str], ...]


_SMART_HOME = Cluster(
    name="smart_home_manual",
    system=(
        "You are Nova, the assistant for the Halden H5 smart home hub. Answer briefly and use "
        "only the manual below; if it does not say, tell the user to contact support.\n\n"
        "Halden H5 Hub - Owner's Manual\n\n"
        "Setup. Place the hub in a central spot, at least 1 m above the floor and 2 m from a "
        "microwave oven. Plug in the 9 V adapter. The status light is amber while the hub boots "
        "(about 45 seconds) and turns steady green when ready. In the Halden app tap Add Hub and "
        "scan the QR code under the hub. The hub needs a 2.4 GHz or 5 GHz Wi-Fi network secured "
        "with WPA2 or WPA3; Ethernet is also supported through the port on the back.\n\n"
        "Devices. The H5 supports Zigbee, Thread and Matter devices, up to 150 in total. Zigbee "
        "devices must be within 12 m of the hub while pairing; hold the device button for 5 "
        "seconds to enter pairing mode. Battery devices report their level every 4 hours and "
        "the app warns at 20 percent. A device silent for 36 hours is shown as offline.\n\n"
        "Automations. Up to 250 automations run locally on the hub, so they keep working when "
        "the internet is down. A trigger can be a time, sunrise or sunset, a sensor value or a "
        "phone arriving home. Away mode turns lights on and off at random between 18:00 and "
        "23:30 to make the house look occupied.\n\n"
        "Status light. Blinking blue: pairing mode. Blinking red: no network connection. Solid "
        "red: hardware fault, contact support. Purple: firmware update in progress; do not "
        "unplug the hub.\n\n"
        "Updates. Firmware updates install automatically between 02:00 and 05:00 local time "
        "and take up to 10 minutes. Automations pause during the update.\n\n"
        "Reset. To restart, unplug the hub for 10 seconds. To factory reset, hold the Reset "
        "button on the back for 15 seconds until the light flashes white three times; this "
        "erases all devices, automations and Wi-Fi settings.\n\n"
        "Warranty. The hub has a 2-year limited warranty. Keep it indoors between 0 and 40 "
        "degrees Celsius."
    ),
    intents=(
        (
            "How do I factory reset the hub?",
            "What are the steps to reset the hub to factory settings?",
            "Factory reset the H5, how?",
            "Could you tell me how to wipe the hub back to factory defaults?",
        ),
        (
            "What does a blinking red light on the hub mean?",
            "Why is my hub's light flashing red?",
            "Hub blinking red, what does that indicate?",
            "Can you explain what the flashing red status light means?",
        ),
        (
            "How many devices can the hub support?",
            "What is the maximum number of devices on the H5?",
            "Max devices the hub can handle?",
            "Is there a limit to how many devices I can connect?",
        ),
        (
            "Do automations still work when the internet is down?",
            "Will my automations keep running without an internet connection?",
            "Automations during an internet outage, do they work?",
            "If my internet goes out, do the automations stop?",
        ),
        (
            "When are firmware updates installed?",
            "At what time does the hub update its firmware?",
            "Firmware update schedule for the hub?",
            "Could you tell me when the hub installs new firmware?",
        ),
        (
            "How close must a Zigbee device be to pair?",
            "What is the pairing range for Zigbee devices?",
            "Zigbee pairing distance from the hub?",
            "How far from the hub can a Zigbee device be when pairing?",
        ),
        (
            "At what battery level does the app warn me?",
            "When does the app send a low battery warning?",
            "What is the low battery warning threshold?",
            "What percentage triggers the battery warning in the app?",
        ),
        (
            "What does away mode do?",
            "Can you explain how away mode works?",
            "Away mode, what is it for?",
            "What happens when I turn on away mode?",
        ),
    ),
)


_PHONE_TOOLS = Cluster(
    name="phone_tools",
    system=(
        "You are the assistant on a smartphone. Answer briefly and use only the tools listed "
        "below; when a request needs a tool, say which tool you would call and with which "
        "arguments.\n\n"
        "Available tools (JSON specs):\n"
        '{"name": "set_alarm", "description": "Create an alarm on the clock app.", '
        '"parameters": {"time": "string, 24-hour HH:MM, required", "label": "string, '
        'optional", "repeat_days": "list of weekday names, optional, default none"}}\n'
        '{"name": "send_message", "description": "Send an SMS to a contact.", "parameters": '
        '{"contact": "string, contact name or phone number, required", "text": "string, at '
        'most 480 characters, required"}}\n'
        '{"name": "get_weather", "description": "Weather forecast for up to 7 days ahead.", '
        '"parameters": {"location": "string, optional, default current location", "days": '
        '"integer 1-7, default 1"}}\n'
        '{"name": "create_event", "description": "Add an event to the calendar.", '
        '"parameters": {"title": "string, required", "start": "ISO 8601 datetime, required", '
        '"duration_min": "integer, default 60", "reminder_min": "integer, default 15"}}\n'
        '{"name": "start_timer", "description": "Start a countdown timer.", "parameters": '
        '{"minutes": "integer 1-1440, required"}}\n'
        '{"name": "play_music", "description": "Play music from the local library.", '
        '"parameters": {"query": "string, artist, album or song, required", "shuffle": '
        '"boolean, default false"}}\n'
        '{"name": "set_volume", "description": "Set media volume.", "parameters": {"level": '
        '"integer 0-100, required"}}\n'
        '{"name": "navigate", "description": "Start turn-by-turn navigation.", "parameters": '
        '{"destination": "string, required", "mode": "one of driving, walking, cycling, '
        'transit; default driving"}}\n'
        '{"name": "toggle_setting", "description": "Switch a phone setting.", "parameters": '
        '{"setting": "one of wifi, bluetooth, flashlight, do_not_disturb, airplane_mode", '
        '"on": "boolean, required"}}\n\n'
        "Rules: never send a message without the user confirming the text. There is no tool "
        "for phone calls, email or payments; say so if asked."
    ),
    intents=(
        (
            "Set an alarm for 6:30 tomorrow morning.",
            "Can you wake me up at 6:30 am?",
            "Alarm at 06:30 tomorrow, please.",
            "I need an alarm set for half past six in the morning.",
        ),
        (
            "What's the weather going to be this weekend?",
            "Can you get me the forecast for the next few days?",
            "Weather forecast for the weekend?",
            "Will it rain over the coming weekend?",
        ),
        (
            "Text Sam that I'm running ten minutes late.",
            "Send a message to Sam saying I'll be ten minutes late.",
            "Message Sam: running 10 min late.",
            "Could you let Sam know by SMS that I'm late by ten minutes?",
        ),
        (
            "Start a timer for 20 minutes.",
            "Can you set a twenty minute countdown?",
            "Timer for 20 minutes, go.",
            "Please count down twenty minutes for me.",
        ),
        (
            "Add a dentist appointment on Friday at 3 pm.",
            "Put the dentist in my calendar for Friday, 15:00.",
            "Calendar entry: dentist, Friday at 3pm.",
            "Could you schedule a dentist visit this Friday at three?",
        ),
        (
            "Turn on the flashlight for me.",
            "Can you switch the torch on?",
            "Flashlight on, please, it's dark.",
            "I need the flashlight turned on right now.",
        ),
        (
            "Give me walking directions to the train station.",
            "How do I walk to the train station from here?",
            "Navigate to the train station on foot.",
            "Can you start walking navigation to the station?",
        ),
        (
            "Can you call my mom for me?",
            "Please phone my mother for me.",
            "Call mom on her mobile now.",
            "Is it possible to make a phone call to my mom?",
        ),
    ),
)


_TRAVEL_POLICY = Cluster(
    name="travel_expense_policy",
    system=(
        "You are the HR assistant of Brightwell Analytics. Answer employees briefly and use "
        "only the travel and expense policy below; if the policy does not cover a case, refer "
        "them to finance@brightwell.example.\n\n"
        "Brightwell Travel and Expense Policy (version 4.2)\n\n"
        "1. Approval. Every business trip must be approved by the employee's manager in the "
        "Travel portal at least 10 working days before departure. Trips outside Europe also "
        "need approval from the department director.\n\n"
        "2. Flights. Book economy class for flights under 6 hours. Premium economy is allowed "
        "for flights of 6 hours or more; business class needs written approval from the CFO. "
        "Book through the portal so the company travel agency can issue the ticket.\n\n"
        "3. Hotels. The nightly limit, including taxes, is 180 EUR in most cities and 250 EUR "
        "in London, Paris, Zurich and New York. Breakfast is covered when included in the "
        "room rate.\n\n"
        "4. Meals. The daily meal allowance is 60 EUR for domestic trips and 75 EUR abroad. "
        "Alcohol is not reimbursed, except at client dinners approved in advance. Tips are "
        "reimbursed up to 10 percent of the bill.\n\n"
        "5. Ground transport. Use public transport where practical. Taxis and ride-hailing are "
        "reimbursed for trips to and from airports and after 21:00. Private car use is paid at "
        "0.30 EUR per kilometre. Rental cars must be compact class unless four or more "
        "employees travel together.\n\n"
        "6. Claims. Submit expense claims within 30 days of returning, with an itemised receipt "
        "for every amount over 25 EUR. Claims are paid with the next monthly salary if "
        "submitted before the 20th of the month. Lost receipts need a signed declaration; at "
        "most two are accepted per year.\n\n"
        "7. Per diem and advances. A cash advance of up to 500 EUR can be requested for trips "
        "longer than 5 days. Unused advance money must be returned within 14 days.\n\n"
        "8. Not reimbursed. Traffic and parking fines, minibar items, in-flight "
        "entertainment, personal travel insurance, lounge access and upgrades paid by the "
        "employee."
    ),
    intents=(
        (
            "What is the hotel limit per night in Paris?",
            "How much can I spend on a hotel room in Paris?",
            "What's the Paris hotel nightly cap?",
            "Could you tell me the maximum nightly hotel rate for Paris?",
        ),
        (
            "Can I fly business class?",
            "When am I allowed to book business class flights?",
            "Is business class ever allowed for me?",
            "Is business class travel permitted under the policy?",
        ),
        (
            "How long do I have to submit an expense claim?",
            "What is the deadline for filing expenses after a trip?",
            "What's the deadline for expense claims?",
            "Within how many days must I hand in my expense report?",
        ),
        (
            "What is the daily meal allowance abroad?",
            "How much can I spend on food per day on a foreign trip?",
            "Meal allowance for trips abroad?",
            "Could you tell me the per day food budget outside the country?",
        ),
        (
            "Can I expense a taxi from the airport?",
            "Are taxi rides to the airport reimbursed?",
            "Is an airport taxi ride reimbursable?",
            "Will the company pay for my cab to the airport?",
        ),
        (
            "How far in advance must a trip be approved?",
            "When do I need to get travel approval?",
            "What is the lead time for trip approval?",
            "How many days before departure should my manager approve the trip?",
        ),
        (
            "What is the mileage rate for using my own car?",
            "How much do I get per kilometre for my private car?",
            "Private car rate per km?",
            "Could you tell me the reimbursement for driving my own vehicle?",
        ),
        (
            "What if I lost a receipt?",
            "I lost my receipt, can I still get reimbursed?",
            "Missing a receipt, what do I do now?",
            "How are expenses handled when the receipt is lost?",
        ),
    ),
)


_COOKING = Cluster(
    name="cooking_recipes",
    system=(
        "You are a friendly kitchen assistant. Answer briefly and use only the recipes below; "
        "quantities serve 4 unless stated.\n\n"
        "Recipe 1: Tomato and lentil soup. Ingredients: 200 g red lentils, 1 onion, 2 garlic "
        "cloves, 1 can (400 g) chopped tomatoes, 1 litre vegetable stock, 1 tsp cumin, 2 tbsp "
        "olive oil. Fry the chopped onion in the oil for 5 minutes, add garlic and cumin for 1 "
        "minute, then the rinsed lentils, tomatoes and stock. Simmer 25 minutes and blend. "
        "Vegan; keeps 4 days in the fridge or 3 months frozen.\n\n"
        "Recipe 2: Lemon roast chicken. One 1.6 kg chicken, 1 lemon, 4 garlic cloves, 2 tbsp "
        "butter, thyme, salt. Heat the oven to 200 C. Put the halved lemon and garlic inside "
        "the bird, rub the skin with butter and salt and roast about 80 minutes, until the "
        "thickest part of the thigh reaches 74 C. Rest 10 minutes before carving.\n\n"
        "Recipe 3: Mushroom risotto. 320 g arborio rice, 300 g mushrooms, 1 shallot, 150 ml "
        "white wine, 1.2 litres hot stock, 50 g parmesan, 30 g butter. Toast the rice 2 "
        "minutes, add the wine, then stock one ladle at a time, stirring, for 18 minutes. "
        "Stir in the fried mushrooms, butter and parmesan. For a vegetarian dish use vegetable "
        "stock and a rennet-free hard cheese.\n\n"
        "Recipe 4: Banana bread. 3 ripe bananas, 250 g flour, 100 g sugar, 2 eggs, 80 g melted "
        "butter, 1 tsp baking soda, pinch of salt. Mash the bananas, mix in the wet ingredients, "
        "fold in the dry ones. Bake in a greased 900 g loaf tin at 175 C for 55 to 60 minutes, "
        "until a skewer comes out clean. Makes 10 slices.\n\n"
        "Substitutions. Instead of 1 egg in baking use 3 tbsp apple sauce. Instead of white "
        "wine use stock with 1 tsp lemon juice. Gluten-free flour works in the banana bread "
        "with 1/2 tsp xanthan gum."
    ),
    intents=(
        (
            "How long does the lentil soup need to simmer?",
            "What is the simmering time for the tomato lentil soup?",
            "What's the simmer time for the lentil soup?",
            "For how many minutes should I let the soup cook?",
        ),
        (
            "What temperature should the chicken reach inside?",
            "How do I know when the roast chicken is done?",
            "Roast chicken internal temperature when done?",
            "Could you tell me the safe core temperature for the roast chicken?",
        ),
        (
            "What can I use instead of white wine in the risotto?",
            "Is there a substitute for wine in the mushroom risotto?",
            "Risotto without wine, what to use?",
            "I have no white wine, what should I replace it with?",
        ),
        (
            "How long do I bake the banana bread?",
            "What is the baking time for banana bread?",
            "Banana bread oven time, how many minutes?",
            "For how long should the banana bread stay in the oven?",
        ),
        (
            "Can I freeze the lentil soup?",
            "How long does the lentil soup keep in the freezer?",
            "Is freezing the lentil soup ok?",
            "Is the tomato lentil soup suitable for freezing?",
        ),
        (
            "How can I make the banana bread without eggs?",
            "What replaces eggs in the banana bread?",
            "What's a good egg substitute for baking?",
            "I have no eggs, can I still bake the banana bread?",
        ),
        (
            "How many ripe bananas do I need?",
            "How many bananas go into the banana bread?",
            "Number of bananas for the loaf?",
            "Could you tell me how many bananas the recipe calls for?",
        ),
        (
            "Is the mushroom risotto vegetarian?",
            "Can I make the risotto suitable for vegetarians?",
            "Is a vegetarian version of the risotto possible?",
            "Does the mushroom risotto work for someone who doesn't eat meat?",
        ),
    ),
)


_CAR_MANUAL = Cluster(
    name="car_manual",
    system=(
        "You are the in-car assistant of the Vantor E-Line hatchback. Answer the driver briefly "
        "and use only the owner's manual below; for anything safety related not covered, "
        "advise visiting an authorised workshop.\n\n"
        "Vantor E-Line Owner's Manual (excerpt)\n\n"
        "Dashboard warning lights. Red lights mean stop safely as soon as possible. Red oil can: "
        "oil pressure too low, switch off the engine and check the oil level. Red thermometer: "
        "engine overheating, stop and let the engine cool for at least 30 minutes before "
        "opening the coolant cap. Red battery: charging fault. Amber lights mean drive on with "
        "care and have the car checked soon. Amber engine symbol: engine management fault; if "
        "it flashes, reduce speed, as the catalytic converter may be damaged. Amber "
        "horseshoe with exclamation mark: tyre pressure low.\n\n"
        "Tyres. Recommended cold pressure: 2.3 bar front and 2.1 bar rear, or 2.6 bar front "
        "and 2.5 bar rear with full load. Tyre size 205/55 R16. The legal minimum tread depth "
        "is 1.6 mm; Vantor recommends replacing tyres at 3 mm. After adjusting pressures, reset "
        "the tyre monitor in Settings > Vehicle > Tyres. A repair kit is in the boot floor; "
        "there is no spare wheel. The kit seals punctures up to 4 mm; afterwards drive at no "
        "more than 80 km/h for at most 200 km.\n\n"
        "Maintenance. Service every 20,000 km or every 12 months, whichever comes first. The "
        "engine takes 4.2 litres of 0W-20 oil. Replace the cabin air filter every 2 years and "
        "the brake fluid every 2 years. The timing chain needs no scheduled replacement.\n\n"
        "Fuel. Unleaded petrol, minimum 95 RON; E10 is allowed. Tank capacity 45 litres. Never "
        "use diesel.\n\n"
        "Jump starting. Connect red to the positive terminal under the bonnet, black to the "
        "bare metal earth point on the engine mount. Start the helper car first, wait 3 "
        "minutes, then start the E-Line.\n\n"
        "Towing. Maximum braked trailer 1,200 kg, unbraked 600 kg, nose weight 75 kg."
    ),
    intents=(
        (
            "What tyre pressure should I use?",
            "What is the recommended tyre pressure for this car?",
            "Tyre pressure front and rear?",
            "How much air should I put in the tyres?",
        ),
        (
            "What does the red oil can light mean?",
            "The oil can symbol is lit in red, what should I do?",
            "Red oil warning light on, what now?",
            "Why is the red oil pressure light on my dashboard?",
        ),
        (
            "How often does the car need a service?",
            "What is the service interval for the E-Line?",
            "What's the service interval on this car?",
            "When is the next maintenance due, in kilometres or months?",
        ),
        (
            "What type of fuel does the car take?",
            "Which petrol should I put in the tank?",
            "Fuel type, can I use E10?",
            "Could you tell me what fuel this car needs?",
        ),
        (
            "Does the car have a spare wheel?",
            "What do I do if I get a flat tyre?",
            "Flat tyre, spare wheel or kit?",
            "Is there a spare tyre in the boot?",
        ),
        (
            "How do I jump start the car?",
            "What are the steps to jump start with cables?",
            "What's the jump start procedure for this car?",
            "My battery is flat, how do I connect jumper cables?",
        ),
        (
            "How much oil does the engine take?",
            "What engine oil and how many litres do I need?",
            "Engine oil capacity and grade, please?",
            "Could you tell me the right oil type and quantity?",
        ),
        (
            "How heavy a trailer can I tow?",
            "What is the maximum towing weight?",
            "What's the towing capacity of the E-Line?",
            "Can the E-Line pull a braked trailer of 1,000 kg?",
        ),
    ),
)


_MEDICATION = Cluster(
    name="medication_leaflet",
    system=(
        "You are a pharmacy information assistant. Answer briefly and use only the patient "
        "leaflet below; for anything not covered, tell the user to ask a pharmacist or doctor. "
        "Zentravol is a fictional medicine.\n\n"
        "Patient Information Leaflet: Zentravol 200 mg film-coated tablets\n\n"
        "What it is for. Zentravol relieves mild to moderate pain, such as headache, "
        "toothache, back pain and period pain, and lowers fever. Each tablet contains 200 mg "
        "of the active substance.\n\n"
        "Dosage. Adults and children aged 12 and over: 1 or 2 tablets every 6 hours as needed. "
        "Do not take more than 6 tablets (1,200 mg) in 24 hours. Do not give to children under "
        "12. Swallow whole with a glass of water, preferably with or after food. Do not use "
        "for more than 5 days for pain or 3 days for fever without seeing a doctor.\n\n"
        "Missed or extra doses. If you forget a dose, take it when you remember, but keep at "
        "least 6 hours between doses. Never take a double dose. If you have taken too many "
        "tablets, contact a doctor or emergency department at once, even if you feel well.\n\n"
        "Do not take Zentravol if you are allergic to it, have a stomach ulcer, severe kidney or "
        "liver disease, or are in the last 3 months of pregnancy. Talk to a doctor first if you "
        "have asthma or take blood thinners.\n\n"
        "Alcohol. Avoid alcohol while taking Zentravol; it increases the risk of stomach "
        "bleeding.\n\n"
        "Side effects. Common (up to 1 in 10 people): upset stomach, nausea, heartburn, mild "
        "dizziness. Uncommon (up to 1 in 100): headache, rash, drowsiness. Rare (up to 1 in "
        "1,000): black stools or vomiting blood, swelling of the face or throat, severe "
        "breathing difficulty; stop taking the tablets and seek medical help immediately.\n\n"
        "Driving. Zentravol may cause dizziness or drowsiness; if affected, do not drive.\n\n"
        "Storage. Store below 25 C in the original package to protect from moisture. Keep out "
        "of the sight and reach of children. Do not use after the expiry date on the carton "
        "(EXP); the date refers to the last day of that month."
    ),
    intents=(
        (
            "How many tablets can I take in a day?",
            "What is the maximum daily dose of Zentravol?",
            "Max tablets per 24 hours?",
            "Could you tell me the highest amount I may take per day?",
        ),
        (
            "Can children take Zentravol tablets safely?",
            "Is Zentravol safe for my 10 year old?",
            "What is the minimum age for Zentravol?",
            "From what age may kids use these tablets?",
        ),
        (
            "What are the common side effects?",
            "Which side effects does Zentravol usually cause?",
            "Common side effects of Zentravol, please?",
            "What unwanted effects might I notice when taking it?",
        ),
        (
            "I forgot a dose, what should I do?",
            "What happens if I miss a dose of Zentravol?",
            "Missed a dose, should I take double?",
            "If I skip a tablet, should I make up for it?",
        ),
        (
            "How should I store the tablets?",
            "What are the storage conditions for Zentravol?",
            "What storage temperature do the tablets need?",
            "Where is the best place to keep this medicine?",
        ),
        (
            "Can I drink alcohol while taking Zentravol?",
            "Is it okay to have a beer with these tablets?",
            "Is alcohol ok with Zentravol?",
            "Should I avoid drinking while on this medication?",
        ),
        (
            "Can I take Zentravol while pregnant?",
            "Is Zentravol safe during pregnancy?",
            "Pregnant, is Zentravol ok to take?",
            "I'm expecting a baby, may I use these tablets?",
        ),
        (
            "Should I take it with food?",
            "Do the tablets need to be taken with a meal?",
            "Take Zentravol with or without food?",
            "Is it better to take Zentravol on an empty stomach or after eating?",
        ),
    ),
)


_ISP_SUPPORT = Cluster(
    name="isp_support_kb",
    system=(
        "You are the support assistant of Skyline Fibre, an internet provider. Answer "
        "customers briefly and use only the knowledge base below; if it does not help, offer a "
        "chat with a human agent.\n\n"
        "Skyline Fibre Knowledge Base\n\n"
        "KB-101 Plans. Fibre 150: 150/30 Mbit/s, 29.99 per month. Fibre 500: 500/100 Mbit/s, "
        "39.99 per month. Fibre 1000: 1000/250 Mbit/s, 49.99 per month. All plans have "
        "unlimited data and a 12-month minimum term; upgrades are possible at any time and "
        "take effect within 24 hours. Downgrades are only possible after the minimum term.\n\n"
        "KB-102 Router lights. The SkyBox 6 router shows a white light when online. Blinking "
        "white: starting up or updating, wait up to 5 minutes. Orange: no fibre signal, check "
        "that the green fibre cable is firmly connected to the wall box. Red: the line is down "
        "in your area or there is a fault; check the outage map at status.skyline.example.\n\n"
        "KB-103 Slow Wi-Fi. Restart the router by unplugging it for 30 seconds. Place it "
        "centrally, off the floor and away from metal objects. Use the 5 GHz network "
        "(name ending in -5G) for speed, and 2.4 GHz for range. For speed tests use a cable; "
        "Wi-Fi speeds are typically 40 to 60 percent of the plan speed.\n\n"
        "KB-104 Wi-Fi password. The default network name and password are printed on the label "
        "under the router. To change them, open 192.168.1.1 in a browser, log in with the admin "
        "password from the same label and go to Wireless > Security.\n\n"
        "KB-105 Billing. Bills are issued on the 1st of each month and collected by direct "
        "debit on the 10th. A failed payment costs a 5.00 fee. Paper bills cost 1.50 each.\n\n"
        "KB-106 Moving house. Tell us at least 3 weeks before moving. The move is free if the "
        "new address has Skyline Fibre coverage; otherwise the contract ends without a fee.\n\n"
        "KB-107 Cancelling. After the minimum term give 30 days notice by phone or in the "
        "account portal. Return the router within 14 days of the end date or pay 80.00."
    ),
    intents=(
        (
            "My router light is orange, what does that mean?",
            "Why is the SkyBox showing an orange light?",
            "Orange light on the router, what now?",
            "The light on my router turned orange, how do I fix it?",
        ),
        (
            "Why is my Wi-Fi so slow?",
            "How can I make my wireless internet faster?",
            "Slow Wi-Fi at home, any quick fixes?",
            "My Wi-Fi speed is poor, what should I try?",
        ),
        (
            "How do I change my Wi-Fi password?",
            "Where can I set a new wireless password?",
            "How to change the Wi-Fi password?",
            "Could you walk me through changing the network password?",
        ),
        (
            "How much does the 500 Mbit plan cost?",
            "What is the monthly price of Fibre 500?",
            "What's the price of Fibre 500?",
            "Could you tell me what I'd pay per month for 500 megabits?",
        ),
        (
            "When is my bill paid by direct debit?",
            "On what day is the monthly payment taken?",
            "What is the direct debit date?",
            "Which day of the month do you collect the bill amount?",
        ),
        (
            "I'm moving house, what do I need to do?",
            "How do I take my internet to a new address?",
            "Moving, how to transfer my plan?",
            "What happens to my contract when I relocate?",
        ),
        (
            "How do I cancel my contract?",
            "What is the notice period to cancel Skyline Fibre?",
            "How can I cancel my subscription?",
            "Could you explain how to end my internet service?",
        ),
        (
            "Can I upgrade to a faster plan?",
            "How quickly does a plan upgrade take effect?",
            "Upgrade to Fibre 1000, possible?",
            "Is it possible to switch to a faster speed before my term ends?",
        ),
    ),
)


_CODE_REVIEW = Cluster(
    name="code_review",
    system=(
        "You are a code-review assistant. Answer briefly and only about the Python file below, "
        "citing the function names involved.\n\n"
        "File: inventory.py\n"
        "```python\n"
        "import json\n"
        "import time\n"
        "\n"
        "CACHE = {}\n"
        "\n"
        "\n"
        "def load_items(path):\n"
        "    f = open(path)\n"
        "    data = json.load(f)\n"
        "    return data['items']\n"
        "\n"
        "\n"
        "def find_item(items, sku):\n"
        "    for i in range(len(items)):\n"
        "        if items[i]['sku'] == sku:\n"
        "            return items[i]\n"
        "\n"
        "\n"
        "def add_stock(item, qty, log=[]):\n"
        "    item['stock'] += qty\n"
        "    log.append((item['sku'], qty, time.time()))\n"
        "    return log\n"
        "\n"
        "\n"
        "def total_value(items):\n"
        "    total = 0\n"
        "    for item in items:\n"
        "        total = total + item['price'] * item['stock']\n"
        "    return round(total, 2)\n"
        "\n"
        "\n"
        "def get_price(sku, items):\n"
        "    if sku in CACHE:\n"
        "        return CACHE[sku]\n"
        "    price = find_item(items, sku)['price']\n"
        "    CACHE[sku] = price\n"
        "    return price\n"
        "\n"
        "\n"
        "def remove_stock(item, qty):\n"
        "    try:\n"
        "        item['stock'] -= qty\n"
        "    except:\n"
        "        pass\n"
        "\n"
        "\n"
        "def low_stock(items, threshold=5):\n"
        "    result = []\n"
        "    for item in items:\n"
        "        if item['stock'] < threshold:\n"
        "            result.append(item['sku'])\n"
        "    return result\n"
        "\n"
        "\n"
        "def save_items(path, items):\n"
        "    with open(path, 'w') as f:\n"
        "        f.write(json.dumps({'items': items}))\n"
        "```\n\n"
        "Reviewer notes: the team targets Python 3.11 and uses pytest. Prices are floats in "
        "EUR. The file has no tests yet. The style guide requires type hints on public "
        "functions and forbids bare except clauses. find_item returns None when nothing "
        "matches, and the CACHE in get_price is never invalidated when prices change. "
        "remove_stock can drive stock below zero, since nothing checks qty against the "
        "current stock. save_items overwrites the file in place, so a crash while writing "
        "can leave a truncated file; writing to a temporary file and renaming is safer."
    ),
    intents=(
        (
            "Is there a resource leak in load_items?",
            "Does load_items close the file it opens?",
            "Is the file handle in load_items leaked?",
            "Could you check whether the file in load_items is closed properly?",
        ),
        (
            "What is wrong with the default argument in add_stock?",
            "Why is log=[] in add_stock a problem?",
            "Is there a mutable default argument in add_stock?",
            "Can you explain the bug with the log list default?",
        ),
        (
            "What happens if find_item does not find the SKU?",
            "What does find_item return when there is no match?",
            "What is find_item's behaviour for a missing SKU?",
            "Could get_price crash when the SKU does not exist?",
        ),
        (
            "Why is the bare except in remove_stock bad?",
            "What is wrong with remove_stock's error handling?",
            "Any issue with the except clause in remove_stock?",
            "Can you review the try/except in remove_stock?",
        ),
        (
            "Can find_item be written more idiomatically?",
            "How would you simplify the loop in find_item?",
            "Is there a cleaner version of the find_item loop?",
            "Is there a more Pythonic way to write find_item?",
        ),
        (
            "Is the price cache in get_price safe?",
            "What are the risks of the CACHE dict in get_price?",
            "Can the get_price cache go stale?",
            "Could the cached prices ever become outdated?",
        ),
        (
            "Should these functions have type hints?",
            "Does the code follow the style guide on annotations?",
            "Are type hints missing from this file?",
            "Which functions need type annotations added?",
        ),
        (
            "Is using floats for prices a good idea?",
            "Could float prices cause rounding problems in total_value?",
            "Are floats for money ok here?",
            "What type should total_value use for money amounts?",
        ),
    ),
)


CLUSTERS: tuple[Cluster, ...] = (
    _SMART_HOME,
    _PHONE_TOOLS,
    _TRAVEL_POLICY,
    _COOKING,
    _CAR_MANUAL,
    _MEDICATION,
    _ISP_SUPPORT,
    _CODE_REVIEW,
)
